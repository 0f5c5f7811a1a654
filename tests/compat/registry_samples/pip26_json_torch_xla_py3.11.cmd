pip --isolated --disable-pip-version-check index versions --json --index-url https://pypi.org/simple torch_xla --python-version 3.11 --only-binary=:all:
