import otbrl


def test_version_is_a_string():
    assert isinstance(otbrl.__version__, str) and otbrl.__version__.count(".") == 2
