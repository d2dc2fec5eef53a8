"""What the tests share: the engine harness (a config, batches, the plain-PyTorch reference
run, an engine run), the small models, and the layer under test (the device the
suite runs on). Tests of every folder import from here, none from another test folder."""
