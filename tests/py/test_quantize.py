def test_placeholder_quantize():
    pass
