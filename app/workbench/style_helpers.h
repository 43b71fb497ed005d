#pragma once
// Small look-and-feel helpers shared by the pages, so secondary text and headings look the same
// everywhere and follow the palette (light or dark).
#include <QColor>
#include <QFont>
#include <QPalette>

class QWidget;

namespace hh::workbench {

// Secondary text: between the text and the background colour, readable but clearly quieter than
// the palette's disabled colour (which reads as "unavailable").
QColor mutedTextColor(const QPalette& palette);
// Gives `w` the muted text colour for labels (WindowText) and item views (Text).
void setMuted(QWidget* w);
// A heading font derived from `base`: bold and `scale` times larger.
QFont headingFont(const QFont& base, double scale = 1.4);

}  // namespace hh::workbench
