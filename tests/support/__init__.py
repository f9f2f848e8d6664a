"""What several test files share: oracles, bounds, fixtures built by hand or damaged on purpose.

Imported as `support.X` (pytest puts tests/ on sys.path, and tests/conftest.py does too); no test
module imports another (tests/test_repository.py holds that rule)."""
