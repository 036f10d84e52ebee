"""dflashctl: the control plane. Renders, submits and watches the Kubernetes Jobs of a run.

Importing it never imports torch or transformers.
"""

__version__ = "0.1.0"
