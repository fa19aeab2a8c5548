"""racer inside other serving engines; each module imports its engine only when used."""
