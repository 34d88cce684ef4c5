"""vcfslm: from a VMware Cloud Foundation cluster to a measured, sized SLM inference service.

Importing this package stays cheap: torch, transformers and pyVmomi are imported
lazily by the modules that need them.
"""

__version__ = "0.1.0"
