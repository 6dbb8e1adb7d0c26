"""otbrl.data"""
