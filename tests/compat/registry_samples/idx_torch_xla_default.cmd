pip --isolated --disable-pip-version-check index --index-url https://pypi.org/simple versions torch_xla
