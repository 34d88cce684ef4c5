"""The rank engine: the model and its checkpoint, the packed linears, the compiled decode
and slot steps, the numerics gate and the probes. Only this room imports torch's compiled
paths; `import vcfslm.engine` stays cheap (torch is imported by the modules that need it).
"""
