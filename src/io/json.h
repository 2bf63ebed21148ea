// json.h: the one strict way src/ reads JSON (cJSON underneath): a text that another reader
// of the same bytes (Python's json, the tokenizers package) would read otherwise is an error.
#ifndef LB_JSON_H
#define LB_JSON_H

#include <stddef.h>
#include <cJSON.h>

// Parses the len bytes at text as one JSON value. Refused, with "name:line: what" in err
// (line counted from first_line, the line text starts on): a NUL byte, raw or as \u0000 in a
// string (C strings would end there); anything but white space after the value; a key twice
// in one object (cJSON keeps the first, Python the last); and what is not JSON. NULL then.
cJSON *lb_json_parse(const char *text, size_t len, const char *name, int first_line, char *err,
                     size_t errlen);

#endif
