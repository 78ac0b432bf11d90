import pytest

# Detailed assertion messages for the shared checks in the helper module too.
pytest.register_assert_rewrite("tests.training.jobs")
