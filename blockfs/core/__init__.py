"""The packed format and reading it: block and index layouts, the block store, the dataset's file-system view,
verification and unpacking.  Imports neither a FUSE binding nor torch; every other part builds on this one."""
