"""The DFlash drafter: the model (`model`), the frozen target tensors it borrows (`checkpoint`) and
the z-lab export that vLLM loads (`export`)."""
