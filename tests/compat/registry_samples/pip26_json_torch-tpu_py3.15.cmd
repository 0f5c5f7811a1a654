pip --isolated --disable-pip-version-check index versions --json --index-url https://pypi.org/simple torch-tpu --python-version 3.15 --only-binary=:all:
