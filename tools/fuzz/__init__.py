"""The fuzzer's mutation families and invariant (issue 17), owned by tools/ and imported by the tests.

``tools/fuzz_dataset.py`` runs thousands of mutations, ``tests/test_hostile_mutations.py`` a derandomized
handful per family, both from this one code path: :mod:`fuzz.mutations` (the families, on a fresh copy of
a pristine pack), :mod:`fuzz.invariant` (what every reader must keep), :mod:`fuzz.indexutil` (an index
or its metadata edited as a hostile writer would), :mod:`fuzz.forgery` (bytes that keep a CRC-32) and
:mod:`fuzz.treesnap` (a tree as one comparable value).  ``tools/`` is on the tests' path (pyproject.toml).
"""
