def test_placeholder_checkpoints():
    pass
