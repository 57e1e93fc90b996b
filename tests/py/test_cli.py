def test_placeholder_cli():
    pass
