"""Training data: synthetic rows, parquet tables and text, a user's Dataset, the
driver's plan of what the data decides, and what each worker reads."""
