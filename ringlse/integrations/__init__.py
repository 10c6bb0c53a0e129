"""Integrations with model libraries (optional extras): `ringlse.integrations.transformers`."""
