pip --isolated --disable-pip-version-check index --index-url https://pypi.org/simple versions libtpu --python-version 3.13 --only-binary=:all:
