-- A second database on the same server for MLflow's tracking and registry tables.
CREATE DATABASE mlflow;
