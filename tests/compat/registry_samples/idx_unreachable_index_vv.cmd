pip --isolated --disable-pip-version-check index versions -vv --index-url https://127.0.0.1:9/simple --retries 0 --timeout 3 torch-tpu
