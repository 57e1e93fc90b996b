def test_placeholder_formats():
    pass
