"""`folio bench`: throughput, serving latency, the Transformers baseline, the machine's roofline, test models.

Timings on a shared CPU are noisy, so every benchmark that compares things measures them side by side in one
run and prints ratios; absolute numbers are only as good as the machine was quiet.
"""
