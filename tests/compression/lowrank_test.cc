// tests for this codec family are added here
