"""A user's package of plug-in algorithms, for the composition tests (``userpkg.myppo``)."""
