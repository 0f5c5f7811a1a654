pip --isolated --disable-pip-version-check index versions --index-url https://pypi.org/simple torch --python-version 3.x --only-binary=:all:
