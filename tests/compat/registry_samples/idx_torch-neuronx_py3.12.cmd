pip --isolated --disable-pip-version-check index versions --index-url https://pypi.org/simple torch-neuronx --python-version 3.12 --only-binary=:all:
