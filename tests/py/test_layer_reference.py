def test_placeholder_layer_reference():
    pass
