#include "placeholder_page.h"

#include <QLabel>
#include <QVBoxLayout>

#include "style_helpers.h"

namespace hh::workbench {
namespace {
constexpr int kTextMaxWidth = 620;  // px; a comfortable line length for the description
}

PlaceholderPage::PlaceholderPage(const QString& title, const QString& description, QWidget* parent)
    : QWidget(parent), title_(title) {
  auto* heading = new QLabel(title, this);
  heading->setFont(headingFont(heading->font()));

  auto* status = new QLabel(tr("Not available in this version yet."), this);
  QFont italic = status->font();
  italic.setItalic(true);
  status->setFont(italic);

  auto* text = new QLabel(description, this);
  text->setObjectName(QStringLiteral("placeholderDescription"));
  text->setWordWrap(true);
  text->setMaximumWidth(kTextMaxWidth);
  text->setTextInteractionFlags(Qt::TextSelectableByMouse);
  setMuted(status);

  auto* layout = new QVBoxLayout(this);
  layout->setContentsMargins(12, 10, 12, 10);
  layout->setSpacing(8);
  layout->addWidget(heading);
  layout->addWidget(status);
  layout->addSpacing(6);
  layout->addWidget(text);
  layout->addStretch(1);
}

}  // namespace hh::workbench
