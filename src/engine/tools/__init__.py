"""What a user asks for by a key, outside training itself."""
