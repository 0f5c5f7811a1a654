"""Built-in backend plugins, installed as ``accelport._backends``.

Each module is a pluggy plugin registered through the same code path as a
third-party package's ``accelport`` entry point (see accelport/plugins.py).
"""
