"""The DFlash drafter: the model (`model`, `masks`), the frozen target tensors it borrows
(`checkpoint`), speculative decoding with it (`speculative`), the z-lab export that vLLM loads
(`export`) with its Hugging Face entry point (`dflash`), and how to serve it (`serving`). DFlash2's
modules and entry point sit beside them (`dflash2_model`, `dflash2`), flat, as the export copies them.
Every drafter's anchor layout is the spec's (dflash_jobs.spec.anchor_layout): torch-free, read by the
spec for its defaults."""
