"""Drafter training: `python -m dflash_jobs.train -f SPEC` under torchrun (DESIGN section 7)."""
