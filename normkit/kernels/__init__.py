"""The kernels, and nothing else: ``normkit.kernels.norm`` (every function there is ``@triton.jit``) and
``normkit.kernels.norm_pallas`` (the same three as Pallas kernel bodies). Neither is imported here: the
Triton kernels need the triton package, which the Pallas implementation does not."""
