"""Deliberate damage for tests."""


def flip_byte(path: str, offset: int, mask: int = 0x80) -> None:
    """XOR one byte of a file in place: the smallest corruption a checksum must catch."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ mask]))
