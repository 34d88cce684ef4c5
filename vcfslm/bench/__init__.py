"""The run: torchrun and its workers (static, in-process serving, HTTP serving), the window
barriers, placement facts, the local and cluster drivers and their launch lines.
`import vcfslm.bench` stays cheap: the workers import the engine only when they run.
"""
