"""Presentation shared by the terminal and the HTML report: numbers and texts as people read
them (`numbers`, `text`) and search trees drawn for the terminal (`tree`). Pure: data in,
strings or rich renderables out; what is drawn is read elsewhere (`metaloom.search.trace`)."""
