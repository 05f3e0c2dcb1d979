-- Runs once, when the postgres volume is first created: MLflow's database beside Prefect's.
CREATE DATABASE mlflow OWNER paperline;
