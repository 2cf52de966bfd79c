"""The memory tier: blocks held in memory (block_cache, block_memory), which blocks it keeps (policies,
retain) and loads ahead (background_loads, readahead), files read without a block (uncached), its
counters (cache_stats) and its plan (memory_plan, mount_plan, budget).  Importing this package imports
nothing: ``budget`` must stay importable without NumPy."""
