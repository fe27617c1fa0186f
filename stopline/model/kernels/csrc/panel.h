/* The packed weight layouts' one shared width: a panel is 32 output columns (two 16-lane
 * vectors, two 16-column AMX tiles), built by quant_linear.py and bf16_linear.py. */
#ifndef STOPLINE_PANEL_H
#define STOPLINE_PANEL_H
#define PANEL 32
#endif
