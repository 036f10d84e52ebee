"""Hidden-state extraction (DESIGN section 5): `python -m dflash_jobs.extract -f SPEC [--shard I]`."""
