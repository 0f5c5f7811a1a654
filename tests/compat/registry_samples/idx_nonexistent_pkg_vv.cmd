pip --isolated --disable-pip-version-check index versions -vv --index-url https://pypi.org/simple accelport-no-such-pkg-zz
