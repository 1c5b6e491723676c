"""The data: sources, conversations rendered as served, the token store, datagen."""
