pip --isolated --disable-pip-version-check index --index-url https://pypi.org/simple versions torch-tpu --python-version 3.14 --only-binary=:all:
