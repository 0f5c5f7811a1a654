pip --isolated --disable-pip-version-check index versions --index-url https://pypi.org/simple numpy
