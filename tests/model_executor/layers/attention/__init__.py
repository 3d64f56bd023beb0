"""A package so these test modules get package-qualified names: ``test_registry.py`` here and
``fused_moe/test_registry.py`` share a basename, which pytest's default (prepend) import mode
refuses in one session unless one of them sits in a package."""
