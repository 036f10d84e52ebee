"""dflash_jobs: the data plane, the code the pods run (prepare, extract, train, evaluate).

The contract modules `spec`, `storage` and `formats` import no torch at module level, so the
control plane can read specs, markers and manifests with a light install.
"""

__version__ = "0.1.0"
