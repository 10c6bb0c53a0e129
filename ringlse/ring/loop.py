"""The ring's entry points under their former module name (`ringlse.ring.entry` holds them; the loops
are `ringlse.ring.forward` and `ringlse.ring.backward`), kept for callers that import them from here."""

from ringlse.ring.entry import RingPlan, ring_attention, ring_plan

__all__ = ["RingPlan", "ring_attention", "ring_plan"]
