CODES: dict[str, int]
