"""The LSE toolkit: softmax, log_softmax, logsumexp and the log-semiring bmm, safe for `-inf`.

On CUDA tensors of float32/float16/bfloat16 these run the Triton kernels of `ringlse.lse.kernels`
(`softmax/`, `log_bmm.py`; imported on first use, so importing this package needs neither Triton nor
a GPU). Everything else (CPU, float64) runs the PyTorch paths (`torch_paths.py`). Semantics (of both paths, but
for the kernels' known gap below):

- arithmetic is float32 for float32/float16/bfloat16 inputs (float64 for float64), outputs are in the
  input dtype, except `log_bmm`, whose output is float32 (float64 if either input is float64);
- NaN and `+inf` follow torch: a row holding a NaN gives NaN everywhere (softmax, log_softmax) and a NaN
  logsumexp; a row holding `+inf` (and no NaN) gives NaN everywhere for softmax and log_softmax and
  `+inf` for logsumexp; a `log_bmm` entry is what `torch.logsumexp(a[:, :, :, None] + b[:, None], 2)`
  gives (NaN where a term is NaN or `+inf + -inf`, else `+inf` where a term is `+inf`). Gradients
  through such rows are NaN or match torch's where torch's are finite;
- the checks come first, before any work: `dim` out of range raises `IndexError` naming the function;
  an unsupported dtype raises `TypeError` naming the function and the dtype.

Known gap: the Triton kernels (CUDA) do not yet follow torch on rows holding NaN or `+inf` (softmax
gives 0 beside the NaN entries, log_softmax gives `x`, logsumexp and `log_bmm` NaN for `+inf`; the
cooperative softmax kernels give 0 for rows of NaN only): `tests/test_lse_semantics.py` lists each case
as a strict xfail. Rows of finite and `-inf` entries follow the semantics above on both paths.

Differences from torch (deliberate):

- an all `-inf` row is empty, not NaN: softmax 0, log_softmax `-inf`, logsumexp `-inf` (as torch), with
  no NaN forward or backward (`torch.softmax` / `torch.log_softmax` give NaN there); its softmax and
  logsumexp gradients are 0, its log_softmax gradient is `g` (`dx = g - exp(y) * sum(g)`, `exp(y) = 0`);
- softmax / log_softmax of integer or bool tensors raise `TypeError` (torch raises `NotImplementedError`);
  logsumexp of them computes in, and returns, the default float dtype, as `torch.logsumexp` does;
- only float16, bfloat16, float32 and float64 are taken (complex and float8 raise `TypeError`;
  `torch.logsumexp` takes complex);
- `log_bmm` (no torch counterpart) takes floating inputs only (else `TypeError`); mixed floating dtypes
  are allowed (unlike `torch.bmm`) and computed as described above, each gradient in its input's dtype.

Layout: `functions.py` (the public functions: checks and dispatch), `torch_paths.py` (the PyTorch
paths), `kernels/` (the Triton kernels and their launcher). The toolkit is a corner of its own: it may
use the attention path's shared helpers (`ringlse.kernel_import`, `ringlse.kernels.host`), and nothing
on the attention path imports it.
"""

from ringlse.lse.functions import log_bmm, log_softmax, logsumexp, softmax

__all__ = ["log_bmm", "log_softmax", "logsumexp", "softmax"]
