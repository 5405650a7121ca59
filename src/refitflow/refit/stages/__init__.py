"""The eight stages of a refit, one module each, in the order a bucket meets them: ``discover`` (find a
publication, begin), ``plan`` (make the attempt, send its buckets), ``allocate`` (lease staging), ``pull`` (read),
``translate`` (pair staged bytes with destination boxes), ``apply`` (copy and cast on the device), ``verify``
(hash and compare; free staging), ``commit`` (credit coverage, hand verified buckets to relay readers; prepare).
"""
