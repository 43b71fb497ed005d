#pragma once
// QCustomPlot for a build with QT_NO_KEYWORDS: its header is written with Qt's `signals`, `slots`,
// `emit` and `foreach` keywords, so they exist only while it is read. Include this, never
// <qcustomplot.h> directly.
#define signals Q_SIGNALS
#define slots Q_SLOTS
#define emit Q_EMIT
#define foreach Q_FOREACH
#include <qcustomplot.h>
#undef signals
#undef slots
#undef emit
#undef foreach
