"""Data files of the compatibility matrix (TOML); see accelport.compat."""
