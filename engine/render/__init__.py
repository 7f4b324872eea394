"""What people read: answers as HTML, conversations as files (no UI framework here)."""
